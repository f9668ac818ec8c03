"""Placement: which slot a completion request runs on, so that every conversation finds its own cache.

The parts, each importing only those before it:

* request.py: the request's view (its key, its body pinned to a slot, the frozen `RequestView`);
* slots.py: the slot table, the one writer of what each slot holds (no I/O, no policy);
* decide.py: `decide()`, a pure function from the table, the view and the store's index to a `Plan`;
* keeper.py: the one part that talks to llama-server, the turn boundaries and the store;
* prep.py and settle.py: a plan's steps before the request goes, and settling hybrid chats between turns;
* hook.py: `Placement`, the proxy's completion hook, which strings them together.
"""
