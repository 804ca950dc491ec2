"""Requests built on the engine and handles: completions (one slot or parallel slots), chat,
multimodal prompts, embeddings and reranking, fill-in-the-middle, keyword parameters, and
Hugging Face Hub downloads. The ``Llama`` facade is thin methods over these."""
