"""A noisy neighbour for the slowed-host runs: copies a 32 MiB array back and forth (memory bandwidth and
last-level cache, as other tenants' jobs take them) until killed. Usage: nice -n 10 python3 burn.py &"""
import numpy as np

a = np.ones(32 << 20, dtype=np.uint8)
b = np.empty_like(a)
while True:
    np.copyto(b, a)
    np.copyto(a, b)
