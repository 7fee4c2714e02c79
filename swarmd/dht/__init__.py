"""Discovery: signed records of who serves which layers, on the Kademlia DHT.

Empty until the swarm layer lands; a node with the whole model needs no discovery.
"""
