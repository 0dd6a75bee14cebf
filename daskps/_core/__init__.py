"""The numpy core: pure functions on arrays that both sides of daskps share.

Nothing here imports Dask or any other part of daskps: update checks and
arithmetic, dtype defaults and initializer calls, optimizer maths, the
checkpoint piece format, nested structures and pickling helpers. The
parameter servers and the client code both build on it.
"""
