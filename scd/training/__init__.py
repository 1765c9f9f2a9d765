"""The policy network and its GRPO trainer."""
