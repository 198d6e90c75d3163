"""Ops: one module per op. Each is a class built once per shape family and called like a function."""
