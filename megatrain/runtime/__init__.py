"""The runtime: host store, device slots, streams and the executor that interprets a Schedule."""
