"""Clients of the mesh's services: the kv_broker link, the EPLB link and the gateway's
client of prefill, decode and unified instances."""
