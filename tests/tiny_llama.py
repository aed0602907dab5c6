"""The tiny Llama configuration the transformers tests build locally (no download)."""

TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=16,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
"""``LlamaConfig(**TINY_LLAMA)``: 2 layers of width 32 over 64 token ids."""
