"""What several test modules share: model builders, fakes, tokenizers, oracles, paths.
Test modules import from here (and take fixtures from ``conftest.py``), never from each other."""
