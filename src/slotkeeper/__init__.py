"""slotkeeper: keeps llama-server slot caches across restarts."""
