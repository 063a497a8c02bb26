"""One decode step (``decode``), its two-chain layout, the KV-cache session, and the
compiled batch step (``step``)."""
