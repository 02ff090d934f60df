"""mlxserve: gRPC LLM text generation on MLX with a continuous-batching scheduler."""

import os

# transformers (used for tokenizers and chat templates) warns at import that PyTorch is
# absent; we never need PyTorch.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
