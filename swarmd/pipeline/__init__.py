"""Generation across stages: the coordinator's side of every request, and the stage side.

- `coordinator.py`    `Coordinator`: admission, route choice, the DIAG line per request
- `generation.py`     `Generation`: chunked prefill, decode loop, stop strings, timings
- `chain.py`          `StageChain` protocol, `Hop` (no torch)
- `local.py`          `LocalChain`: the route when this node holds all layers
- `route.py`          `plan_route` / `replan`: the pure route planner (shortest path over
                      layer boundaries, standbys, NoRouteError)
- `distributed.py`    `DistributedChain`: a route over peers, with failover and replay
- `ring.py`           `Ring`: the coordinator's end of one session on one route (trio)
- `stage_service.py`  `StageService`: every node's stage end of `/swarmd/stage/1` (trio)
- `links.py`          `Link`, `LoopLink` (a route through this node itself): no torch
- `variants.py`       `choose_variant`: how a node without a model's layers routes it
- `wire.py`           the stage protocol's frames and every check on them (pure)
- `bounds.py`         every bound on what a request asks, one table for the API and the wire
- `placement.py`      `choose_layers`: the range a joining node serves with `--layers auto` (pure)
- `report.py`         `RequestRecord` (the DIAG line), `RequestRing` (recent requests),
                      `FalseReports` (a teller of disproved failure reports is banned)
"""
