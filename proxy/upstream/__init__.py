"""The way to the app: a closed family that imports nothing from the package but the error tree.

- ``forwarder``: what is forwarded (end-to-end headers, the forwarding headers' policy) and the
  transport each upstream URL gets.
- ``transports``: the two transports behind one interface (http:// through ``http1``, https://
  through aiohttp's client), their keep-alive policy and retry.
- ``http1``: the webhook path's keep-alive HTTP/1.1 client (llhttp via httptools).
- ``proxy_headers``: X-Forwarded-* and Forwarded believed only from ``trusted_proxies``.
"""
