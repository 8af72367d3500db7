"""Communication managers: what a prepare/finalize class gets its transport from."""
