"""The project's own code at internet scale, in one process: a discrete-event clock, a network
model calibrated to measurements of the public IPFS network (:mod:`.calibration`), and the DHT's
sans-I/O cores (routing table, lookups, traversal, serving, records) driven over it (:mod:`.dht`).
``bench/scale.py`` runs it; ``docs/SCALE.md`` holds its figures and sources."""
