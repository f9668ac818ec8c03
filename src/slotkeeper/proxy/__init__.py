"""The streaming reverse proxy in front of llama-server, and the gate that holds requests until ready.

A client must not be able to tell slotkeeper from llama-server, except that it is barely slower:

* Method, request target (path and query, byte for byte: ``%2F`` stays ``%2F``), header names, values and
  order, repeated headers, and bodies (compressed ones included) reach the child unchanged; status, reason,
  headers and body bytes come back unchanged. Only hop-by-hop headers are dropped both ways (``Connection``,
  the headers it names, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``,
  ``Proxy-*``), and ``Expect: 100-continue``, which slotkeeper answers itself.
* Bodies stream both ways without size cap, at the pace of the slower side; every chunk of the child's answer
  (an SSE event) is written to the client as soon as it arrives. Only a request body of at most SMALL_BODY
  bytes is read whole first, to go out with the head in one write.
* A client that goes away closes its connection to the child at once, so llama-server cancels a streamed
  generation and frees the slot. A client's EOF (a close, or a half-close: they look the same) goes on to the
  child after the request, so llama-server cancels a non-streamed one as it would for a direct client.
* Nothing is timed out but connecting to the child. A failure before the child's response headers is a 502
  in llama-server's error shape; after them, the client's connection is closed, so it sees a truncated body.

Why protocol callbacks and not aiohttp's server: the proxy is on the path of every token. aiohttp spends
~130 µs of CPU on each proxied request (a task, request and response objects, header multidicts), three times
what llama-server needs to answer a small one, so a proxied /tokenize ran at 0.3x of direct on 2 cores. Here a
request costs a few parser callbacks (httptools, the llhttp parser uvicorn uses) and one write each way, and an
SSE event one read and one write, with no task or future on the way. Tasks appear only off the hot path: a
request waiting for the gate, a new connection to the child, and slotkeeper's own /slotkeeper/ routes.

The modules, each importing only those after it:

* server.py: the Proxy that listens, counts and drains (and holds what its connections share: the pool, the
  gate, slotkeeper's own routes and their API keys, the hook), and the Gate.
* connection.py: the public side. ClientConnection: one client's connection (parsing, routing, writing, flow
  control), the way of each of its requests from the head to the end of the answer.
* front.py: what a ClientConnection works with besides its requests: its FlowControl, and the Proxy and the
  Gate as protocols (Front, GateView), so that connection.py does not import server.py, which creates it.
* messages.py: a client's Request (all of one request's state, from its head to the end of its answer) and
  the Reply slotkeeper gives itself.
* upstream.py: the child's side. ChildConnection and ChildPool (keep-alive connections, the connect timeout),
  the Exchange protocol a ChildConnection calls as an answer arrives (ClientConnection is one), and
  InternalExchange, which carries slotkeeper's own calls to the child (llama/client.py) over the same pool.
* hook.py: the completion hook the proxy calls (placement/hook.py's Placement implements it), and the Placed it returns.

This package imports none of them: `slotkeeper.proxy.hook` or `slotkeeper.proxy.upstream` is imported without
loading the server half.
"""
