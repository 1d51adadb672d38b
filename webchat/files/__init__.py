"""Model files on disk: webchat's home, the default model's download, a .gguf's converted folder, folder checks."""
