"""The common GRPO core: pure tensor functions shared by every strategy."""

from mutualrl.grpo.advantages import (STD_DDOF, Advantages, GroupMoments, group_advantages,
                                      group_moments, normalize, std_from_m2, within_group_ranks)
from mutualrl.grpo.chunked import chunked_token_logprobs
from mutualrl.grpo.loss import (LossOutput, SurrogateSettings, clipped_surrogate, completion_mask,
                                entropy_from_logits, entropy_from_logprobs, sampled_entropy, importance_ratio, k3_kl,
                                selective_log_softmax, token_logprobs)
from mutualrl.grpo.normalise import (NORMALISERS, LossShare, aggregate, loss_normaliser, row_scales,
                                     scaled_sum, token_mean_scale)

__all__ = ["NORMALISERS", "STD_DDOF", "Advantages", "GroupMoments", "LossOutput", "LossShare",
           "SurrogateSettings", "aggregate", "chunked_token_logprobs", "clipped_surrogate", "completion_mask",
           "entropy_from_logits", "entropy_from_logprobs", "sampled_entropy", "group_advantages", "group_moments",
           "importance_ratio", "k3_kl", "loss_normaliser", "normalize", "row_scales", "scaled_sum",
           "selective_log_softmax", "std_from_m2", "token_logprobs", "token_mean_scale",
           "within_group_ranks"]
