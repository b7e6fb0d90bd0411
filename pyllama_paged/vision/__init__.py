"""Images for vision models: decoding and preprocessing (preprocess), a projector file's
vision tower in GGML (projector), and encoded images kept by content hash (image_cache)."""
