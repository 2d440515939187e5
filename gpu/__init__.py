"""GPU codec engine (CuPy kernels, batches, workspace, nvCOMP). Importing it needs cupy and a GPU."""
