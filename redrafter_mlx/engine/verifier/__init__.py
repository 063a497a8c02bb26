"""The verifier: any model mlx-lm builds (``lm_model``) and our own forward for six
families (``model``), their configs, rope and weight files."""
