"""Features built on the engine and handles: embeddings and reranking, fill-in-the-middle, and
Hugging Face Hub downloads."""
