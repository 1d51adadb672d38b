"""Images in the chat: projector files, image decoding, preprocessing, prompt layouts and the vision encoder."""
