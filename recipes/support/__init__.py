"""The recipe's own support: config parsing, data, metrics and the smoke check (not part of the library)."""
