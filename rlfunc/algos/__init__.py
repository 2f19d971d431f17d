"""One short module per algorithm: make_<algo>(config) -> (init, iteration)."""
