"""Stage 3's parameters: the fetcher (gathers, prefetch, the gather-order check), guarded sharded
parameters, gathered_parameters, zero_init."""
