"""The conversation store: saved slot states on disk, found by prefix, never lost to a crash.

* conversations.py: `ConversationStore`, the save and restore protocol with llama-server, and the cap;
* index.py and prefixtree.py: how entries are found in memory (no I/O);
* entries.py: an entry's pair of files, its manifest, its checksum and `judge()`, which `slotkeeper ls` shares;
* slotfiles.py: files on their way between llama-server and entries/ (transient names, space, commit);
* scan.py and manifestcache.py: what a start finds, and the one file that makes a large store's start fast;
* statefile.py: llama.cpp's slot-file header (format, tokens, pictures);
* fingerprint.py: the configuration an entry was saved under; layout.py: the save directory and its lock.
"""
