"""`slotkeeper ls` and `slotkeeper prune`: look at and clean up save directories without a running server.

A save directory (layout.py) holds the conversation store: `entries/<id>.bin` (llama-server's slot file) and
`entries/<id>.json` (its manifest, written last), `quarantine/` (entries llama-server refused, moved aside) and
`snapshots/` (llama-server's --slot-save-path: clients' own save names; counted here, never touched). A directory
of the slot-file layout (`<n>.bin` + `<n>.json` in the directory itself) is listed too: the next slotkeeper
start takes those files over as entries.

Nothing here talks to llama-server. An entry's status is what the next start would make of it: entries.judge(),
the rule ConversationStore.open applies, asked against the configuration of the directory's most recently used
entry (the last run's). With llama-server's arguments after `--`, a match column compares each entry with those
arguments (as far as they decide it offline).

scan reads directories into rows, match compares rows with llama-server arguments, render prints tables and
JSON, prune plans and deletes, shared reads the shared tier, cli holds the two command lines.
"""
