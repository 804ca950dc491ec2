"""The generation engine over the handles: the decode loop, parallel slots, streams,
speculative decoding, prompt caches and stop strings. It never touches ``llamacrab_sys``."""
