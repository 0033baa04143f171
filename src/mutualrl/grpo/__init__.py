"""The common GRPO core: pure tensor functions shared by every strategy."""

from mutualrl.grpo.advantages import (Advantages, GroupMoments, group_advantages, group_moments,
                                      normalize, within_group_ranks)
from mutualrl.grpo.loss import (LossOutput, aggregate, clipped_surrogate, completion_mask,
                                entropy_from_logits, entropy_from_logprobs, importance_ratio, k3_kl,
                                selective_log_softmax, token_logprobs)

__all__ = ["Advantages", "GroupMoments", "LossOutput", "aggregate", "clipped_surrogate",
           "completion_mask", "entropy_from_logits", "entropy_from_logprobs", "group_advantages",
           "group_moments", "importance_ratio", "k3_kl", "normalize", "selective_log_softmax", "token_logprobs",
           "within_group_ranks"]
