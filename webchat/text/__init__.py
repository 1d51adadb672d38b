"""Text in and out of the model: tokenizer, chat templates, history trimming, detokenising, stop strings."""
