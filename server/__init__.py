"""HTTP control plane and the ``orbitkv-cache-manager`` command."""
