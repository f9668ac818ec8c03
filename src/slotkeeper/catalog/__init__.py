"""`slotkeeper ls` and `slotkeeper prune`: look at and clean up save directories without a running server.

A save directory (layout.py) holds the conversation store: `entries/<id>.json` (an entry's manifest, written
last) with, for an entry kept as one file, `entries/<id>.bin` (llama-server's slot file), or for one kept as
blocks, its blocks in `blocks/` (shared by every entry that repeats them), `quarantine/` (entries llama-server
refused, moved aside) and `snapshots/` (llama-server's --slot-save-path: clients' own save names; counted here,
never touched). A directory of the slot-file layout (`<n>.bin` + `<n>.json` in the directory itself) is listed
too: the next slotkeeper start takes those files over as entries.

Nothing here talks to llama-server. An entry's status is what the next start would make of it: entries.judge(),
the rule ConversationStore.open applies, asked against the configuration of the directory's most recently used
entry (the last run's). With llama-server's arguments after `--`, a match column compares each entry with those
arguments (as far as they decide it offline).

The modules, one responsibility each, every one importing only modules listed before it: formats (durations,
sizes, paths, printing), statuses (each status in words), listed (what every row answers), local_rows and
remote_rows (a save directory's rows and the shared tier's), short_ids (ids told apart), blockuse (which blocks a
directory's entries use, and what removing them frees), dirs (which directories, and their lock), scan (a save
directory read into rows), shared (the shared tier read into rows), match (rows against llama-server arguments),
table (padded columns), summaries (the lines under the tables), listing (the tables' text), records (`--json`'s
records) and jsontext (their text), prune (plans and deletes), cli (the two command lines).
"""
