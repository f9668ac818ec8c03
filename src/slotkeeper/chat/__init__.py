"""What llama-server will reuse of a request: its API, its chat form, its prompt as the slot holds it.

No state and no I/O but llama-server's own answers (`/apply-template`, `/tokenize`, through `llama.client`):

* apis.py: the completion APIs by request path, the one table everything else reads;
* convert.py: Responses and Anthropic bodies in chat form, exactly as llama-server converts them;
* attribution.py: Claude Code's per-session attribution line, dropped so that sessions share one opening;
* replies.py: the reply a front end sends back, read from each API's answer;
* prefix.py: a prompt's block keys and exact key (what the store and placement compare);
* media.py: pictures, their ids and positions, and the `MediaBook` that learns them from slot files;
* promptview.py: a prompt's tokens as the slot will hold them, pictures included;
* boundary.py and openings.py: a chat's turn boundary, and its opening (system prompt and tools).
"""
