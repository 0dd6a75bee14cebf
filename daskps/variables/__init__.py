"""Variables and sharded variables: numpy-like handles to arrays held by a server."""
