"""Command-line tools: ``orbitkv-inspect``, ``orbitkv-bench``, ``orbitkv-qualify``. Core imports only."""
