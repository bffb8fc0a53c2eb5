"""The tokenizer kinds behind `kimi_linear_jax.tokenizer` (import them from there): the shared
interface, the chat template, a checkpoint's tokenizer_config.json, and one module per kind
(`byte_level`, `tiktoken_file`, `tokenizer_json`). Not named `tokenizers`: that is the HF
library one of the kinds runs."""
