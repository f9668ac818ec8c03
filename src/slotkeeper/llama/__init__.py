"""llama-server itself: the child process, slotkeeper's calls to it, its sleep, and what its model file says.

* supervisor.py: the child (a private endpoint, its own process group, death with its parent), stopped by
  escalation;
* client.py: slotkeeper's own calls (health, props, tokenize, slot save and restore) over the proxy's pool;
* sleep.py: what slotkeeper knows of llama-server's own sleep (`--sleep-idle-seconds`);
* ggufheader.py, arch.py and modelinfo.py: the model's memory kind from its GGUF header, by llama.cpp's own
  architecture lists, with no tensor loaded;
* policy.py: what llama-server reuses of a restored state for that memory kind (the cache policy).
"""
