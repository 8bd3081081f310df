"""Where a TP group's ranks sit: whole inside one scale-up domain, or the layout cannot exist as priced.

An instance's ranks fill scale-up domains in order (rank r sits in domain r // D, D = `System.scale_up_domain`; an
instance starts on a domain boundary), and a TP group is `tp` consecutive ranks. A TP all-reduce runs every layer, so
the planner prices it over the scale-up fabric (NVLink, Infinity Fabric); a group with ranks in two domains would need
the NIC for part of every all-reduce -- e.g. TP3 on 8-GPU nodes puts ranks 6, 7, 8 on two nodes. Groups stay inside a
domain exactly when the instance fits in one domain, or `tp` divides the domain size. On an HGX box the node and the
domain are the same 8 GPUs; on a GB200/GB300 NVL72 the NVLink domain spans the rack's 18 trays, so a group may span
trays and still all-reduce over NVLink.
"""

from __future__ import annotations

from openk3.planner.hardware import System


def tp_placement_problem(tp: int, num_accelerators: int, system: System) -> str | None:
    """Why `tp`-rank groups cannot all sit inside one scale-up domain of `system` on `num_accelerators` (None when they can)."""
    domain = system.scale_up_domain
    if num_accelerators % tp:
        return f"TP{tp} does not divide {num_accelerators} accelerators into whole groups"
    if num_accelerators <= domain or domain % tp == 0:
        return None
    fits = [t for t in range(1, domain + 1) if domain % t == 0]
    if tp > domain:
        where = f"each TP{tp} group spans {-(-tp // domain)} scale-up domains of {domain}"
    else:
        first = next(g for g in range(0, num_accelerators, tp) if g // domain != (g + tp - 1) // domain)
        where = f"the TP{tp} group of ranks {first}-{first + tp - 1} spans scale-up domains {first // domain} and {(first + tp - 1) // domain}"
    return (
        f"{where} on {system.name} ({domain} accelerators per domain), so its every-layer all-reduce would cross the NIC; "
        f"TP groups must fit whole inside a domain: use a TP that divides {domain} ({', '.join(map(str, fits))})"
    )
