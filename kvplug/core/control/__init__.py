"""``kvplug ctl``: the protocol, the server every engine rank runs, the client, what it asks."""
