"""Context parallelism: the sequence of every sample split over ranks through attention.

- ``layout.py``   which positions each rank holds (zig-zag chunks for the ring, slices for Ulysses)
- ``ring.py``     ring attention (``cp_size``): causal attention with kv chunks rotating over the ring
- ``ulysses.py``  Ulysses (``sp_size``): all-to-alls that turn the sequence split into a head split and back
- ``context.py``  the Engine's glue: the batch cut by the prepared loader, the loss weight, attention routing
"""
