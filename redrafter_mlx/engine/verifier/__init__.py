"""The verifier: any text model mlx-lm builds (``lm_model``; the type the engine names is
``protocol.Verifier``), its cache protocol (``lm_cache``), rope tap (``lm_rope``), slot
rules (``slots``), tensor-parallel split (``shard``), configs and weight files."""
