"""Test doubles for slotkeeper: a fault-injecting stub of llama.cpp's llama-server."""
