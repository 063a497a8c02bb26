"""What every layer stands on: errors, the machine (platform, chip), files and the Hub,
bundled models and prompt sets, the tokenizer and chat format, distributed groups."""
