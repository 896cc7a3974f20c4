"""Model code for one rank's shard of a Mixtral/DeepSeek/Qwen3-style MoE model."""
