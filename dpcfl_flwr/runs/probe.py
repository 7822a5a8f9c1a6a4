"""``dpcfl probe``: will the server find my clusters? Round 1 only, on real data, no Flower.

Runs every client's round-1 DP-SGD on the paper's cluster-structured split, fits the server's
GMM and reports MSS, MPO, E_c, EM iterations and the ARI against the true clusters, with the
Fig. 5 projection plot. RQ5: an MSS above 2 almost always means correct detection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from sklearn.metrics import adjusted_rand_score

from ..clustering import UpdateClusterer, switch_round
from ..data import Topology, load_dataset, make_client_data
from ..dpsgd.training import DPSGDConfig
from ..privacy.budget import plan_noise
from ..privacy.schedule import two_stage_schedule
from ..results.report import plot_projection, write_json_atomic
from .round_one import round_one_updates


@dataclass(frozen=True)
class ProbeSettings:
    dataset: str = "fmnist"
    data_dir: str | None = None
    clusters: str = "3,6,6,6"
    shift: str = "rotation"
    model: str = "cnn"
    samples: int = 2000
    epsilon: float = 10.0
    delta: float = 1e-4
    rounds: int = 200
    batch: int = 32
    first_batch: int | Literal["full"] = "full"
    select_rounds: int = 20
    learning_rate: float = 0.005
    clip: float = 3.0
    n_clusters: int | None = 4
    seed: int = 0
    pca_components: int = 0  # 0: M - 1 (at least 2); 2: the authors' projection
    draw: str = "authors"  # which records each client gets (dpcfl_flwr.data.DRAWS)


def run_probe(settings: ProbeSettings, out_dir: Path, progress: Any = None) -> dict[str, Any]:
    """Compute round-1 updates for every client, cluster them, write probe.json + plot."""
    topology = Topology.parse(settings.clusters)
    train, test = load_dataset(settings.dataset, settings.data_dir)
    clients = [
        make_client_data(train, test, i, topology, settings.shift, settings.samples,
                         seed=settings.seed, test_samples=1, dataset=settings.dataset,
                         draw=settings.draw)
        for i in range(topology.num_clients)
    ]
    schedule = two_stage_schedule(settings.samples, settings.batch, 1, settings.rounds,
                                  settings.first_batch)
    plan = plan_noise(schedule, settings.epsilon, settings.delta, settings.select_rounds)
    config = DPSGDConfig(plan.noise_multiplier, settings.clip, settings.learning_rate,
                         settings.first_batch)
    updates = round_one_updates(clients, settings.model, config, settings.seed,
                                on_client_done=progress)
    fitted = UpdateClusterer(settings.n_clusters, random_state=settings.seed,
                             n_components=settings.pca_components or None).fit(updates)
    truth = [topology.cluster_of(i) for i in range(topology.num_clients)]
    result = {
        "settings": asdict(settings),
        "noise_multiplier": plan.noise_multiplier,
        "n_clusters": fitted.n_clusters_,
        "mss": fitted.mss_,
        "mpo": fitted.mpo_,
        "switch_round": switch_round(fitted.mpo_, settings.rounds),
        "em_iterations": fitted.n_iter_,
        "ari": adjusted_rand_score(truth, fitted.labels_),
        "labels": fitted.labels_.tolist(),
        "true_clusters": truth,
        "candidate_mss": fitted.candidate_mss_,
    }
    write_json_atomic(out_dir / "probe.json", result)
    plot_projection(
        fitted.points_, truth, fitted.means_, fitted.radii_, out_dir / "projection.png",
        f"round-1 updates, b1={settings.first_batch}, eps={settings.epsilon}, "
        f"N={settings.samples}: MSS={fitted.mss_:.2f}",
    )
    return result
