"""Which transport a vllm-nixl pull should take (named per placement) and which one UCX chose
(read from its protocol log); no engine, no GPU."""
from prefillshare.app.engine.nixl import kv_transport
from prefillshare.app.engine.nixl.config import GPU_SETTINGS

# UCX_PROTO_INFO=y output as UCX 1.2x prints it (shape of the tables in UCX's ucp_proto_debug)
GPU_LOG = """\
[1765333150.098983] [gpu-node:1570878:2]  ucp_worker.c:1912 UCX  INFO  ucp_context_0 intra-node cfg#2 rma_am(tcp/eth0) am(tcp/eth0 cuda_ipc/cuda)
[1765333150.1] [gpu-node:1570878:0]   +--------------------------------+-----------------------------------------------------------------+
[1765333150.1] [gpu-node:1570878:0]   | ucp_context_0 intra-node cfg#2 | active message by ucp_am_send* from host memory                 |
[1765333150.1] [gpu-node:1570878:0]   +--------------------------------+--------------------------------------+--------------------------+
[1765333150.1] [gpu-node:1570878:0]   |                         0..8K  | copy-in                              | tcp/eth0                 |
[1765333150.1] [gpu-node:1570878:0]   +--------------------------------+--------------------------------------+--------------------------+
[1765333150.2] [gpu-node:1570878:0]   +--------------------------------+-----------------------------------------------------------------+
[1765333150.2] [gpu-node:1570878:0]   | ucp_context_0 intra-node cfg#3 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1765333150.2] [gpu-node:1570878:0]   +--------------------------------+--------------------------------------+--------------------------+
[1765333150.2] [gpu-node:1570878:0]   |                        0..inf  | zero-copy                            | cuda_ipc/cuda            |
[1765333150.2] [gpu-node:1570878:0]   +--------------------------------+--------------------------------------+--------------------------+
"""
TCP_LOG = """\
[1.0] [n:1:0]   | ucp_context_0 intra-node cfg#1 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1.0] [n:1:0]   |                              0 | copy-out           | tcp/eth0 |
[1.0] [n:1:0]   |                         1..inf | software emulation | tcp/eth0 |
"""
RDMA_LOG = """\
[1.0] [n:1:0]   | ucp_context_0 inter-node cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU3 from cuda/dev[0] |
[1.0] [n:1:0]   |                              0 | copy-out           | rc_mlx5/mlx5_0:1/path0 |
[1.0] [n:1:0]   |                        65..inf | zero-copy          | rc_mlx5/mlx5_0:1 50% on path0 and 50% on path1 |
"""


# NIXL 1.5.1's UCX 1.23 on this CPU box: a NIXL READ between two agents (UCX_PROTO_INFO=y), trimmed
UCX_123_HOST_LOG = """\
[1796457651.976672] [vm:15767:0]   +----------+--------------------+----------------------------------------+
[1796457651.979127] [vm:15767:0]   +--------+-------------+-------------------------------------------+
[1796457651.979127] [vm:15767:0]   | B intra-node cfg#1                                               |
[1796457651.979127] [vm:15767:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796457651.979127] [vm:15767:0]   +--------+-------------+-------------------------------------------+
[1796457651.979127] [vm:15767:0]   | Range  | Description |                  Config                   |
[1796457651.979127] [vm:15767:0]   +--------+-------------+-------------------------------------------+
[1796457651.979127] [vm:15767:0]   | 0..inf | zero-copy   | cma/memory                                |
[1796457651.979127] [vm:15767:0]   +--------+-------------+-------------------------------------------+
[1796457652.052867] [vm:15767:0]   +------------+--------------------+--------------------+
[1796457652.052867] [vm:15767:0]   | B intra-node cfg#1                                   |
[1796457652.052867] [vm:15767:0]   | active message by ucp_am_send*(egr) from host memory |
[1796457652.052867] [vm:15767:0]   +------------+--------------------+--------------------+
[1796457652.052867] [vm:15767:0]   |   Range    |    Description     |    Config          |
[1796457652.052867] [vm:15767:0]   |          0 | short              | tcp/lo             |
"""


def test_ucx_123s_two_line_table_headers_are_read():
    tables = kv_transport.read_protocols(UCX_123_HOST_LOG)
    assert [(t.scope, t.is_read, t.transport) for t in tables] == [("intra-node", True, "cma"),
                                                                     ("intra-node", False, "tcp")]
    assert tables[0].rows == (("0..inf", "zero-copy", "cma/memory"),)
    assert kv_transport.read_transport(UCX_123_HOST_LOG, memory="host") == "cma"
    cuda = UCX_123_HOST_LOG.replace("into host memory from host", "into cuda/GPU0 from cuda/dev[0]").replace(
        "cma/memory", "cuda_ipc/cuda")
    assert kv_transport.read_transport(cuda) == "cuda_ipc"


def test_the_protocol_log_names_the_transport_of_the_kv_reads():
    tables = kv_transport.read_protocols(GPU_LOG)
    assert [t.is_read for t in tables] == [False, True]
    (read,) = [t for t in tables if t.is_read]
    assert read.scope == "intra-node" and read.rows == (("0..inf", "zero-copy", "cuda_ipc/cuda"),)
    assert kv_transport.read_transport(GPU_LOG) == "cuda_ipc"
    assert kv_transport.read_transport(TCP_LOG) == "tcp"  # a pull without CUDA IPC reads
    assert kv_transport.read_transport(RDMA_LOG) == "rc_mlx5"
    assert kv_transport.read_transport(GPU_LOG, memory="host") is None
    assert kv_transport.read_transport("no tables here | at all") is None


def test_a_gpu_engine_with_the_apps_settings_plans_cuda_ipc_in_a_node_and_names_rdma_or_tcp_across():
    p = kv_transport.plan("cuda", env=GPU_SETTINGS.ucx_env, rdma=())
    assert (p.same_node, p.other_nodes) == ("cuda_ipc", "tcp")
    line = kv_transport.describe(p)
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in line and "no RDMA device" in line
    p = kv_transport.plan("cuda", env=GPU_SETTINGS.ucx_env, rdma=("mlx5_0", "mlx5_1"))
    assert p.other_nodes == "rdma" and "mlx5_0, mlx5_1" in kv_transport.describe(p)
    # without the override UCX reads over CUDA IPC only where it finds NVLink
    assert kv_transport.plan("cuda", env={}, rdma=()).same_node == "cuda_ipc with NVLink, else tcp"
    # UCX_TLS can take transports away
    assert kv_transport.plan("cuda", env={**GPU_SETTINGS.ucx_env, "UCX_TLS": "tcp,self"}, rdma=("mlx5_0",)) \
        == kv_transport.TransportPlan("cuda", "tcp", "tcp", kv_transport.plan(
            "cuda", env={**GPU_SETTINGS.ucx_env, "UCX_TLS": "tcp,self"}, rdma=("mlx5_0",)).why)
    assert kv_transport.plan("cuda", env={**GPU_SETTINGS.ucx_env, "UCX_TLS": "^cuda_ipc"}, rdma=()).same_node == "tcp"
    # CPU engines move host memory
    assert kv_transport.plan("cpu", env={}, rdma=()).same_node.startswith("host memory")


def test_rdma_devices_reads_the_sysfs_folder(tmp_path):
    assert kv_transport.rdma_devices(str(tmp_path / "absent")) == ()
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert kv_transport.rdma_devices(str(tmp_path)) == ("mlx5_0", "mlx5_1")
