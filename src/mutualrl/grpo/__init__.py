"""The common GRPO core: pure tensor functions shared by every strategy."""

from mutualrl.grpo.advantages import (Advantages, GroupMoments, group_advantages, group_moments,
                                      normalize, within_group_ranks)
from mutualrl.grpo.loss import (LossOutput, aggregate, clipped_surrogate, completion_mask,
                                entropy_from_logits, k3_kl, selective_log_softmax)

__all__ = ["Advantages", "GroupMoments", "LossOutput", "aggregate", "clipped_surrogate",
           "completion_mask", "entropy_from_logits", "group_advantages", "group_moments", "k3_kl",
           "normalize", "selective_log_softmax", "within_group_ranks"]
