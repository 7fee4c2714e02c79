"""Generation across stages: the coordinator's side of every request.

- `coordinator.py`  `Coordinator`: admission, route choice, the DIAG line per request
- `generation.py`   `Generation`: chunked prefill, decode loop, stop strings, timings
- `chain.py`        `StageChain` protocol, `Hop`, `LocalChain` (this node holds all layers)
- `report.py`       `RequestRecord` (the DIAG line), `RequestRing` (recent requests)
- `route.py`        `plan_route` / `replan`: the pure route planner for distributed
                    generation (shortest path over layer boundaries, standbys, NoRouteError);
                    not yet used by the coordinator
"""
