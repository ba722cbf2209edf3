"""The DHT: Kademlia over the Node's RPC, with expiring values, subkeys and owned records."""
