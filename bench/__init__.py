"""The benchmarks and checks: run from a source checkout, never installed, never imported by the
app (app/ and deployments/). ``python -m bench --help`` lists the commands; the shell scripts
here wrap the longer runs (overload, restart under load, the GPU check) in a loopback namespace.
"""
