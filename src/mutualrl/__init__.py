"""mutualrl: mutual RL post-training of heterogeneous LLM policies with GRPO and shared
experience."""

__version__ = "0.1.0"
