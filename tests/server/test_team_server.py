"""What a team running its own server needs (issue 54): HTTPS (`--ssl-keyfile`,
`--ssl-certfile`) that the unmodified `openai` client talks to, several API keys (`--api-key`
repeated, `--api-key-file`), and a key file read again when it changes, so that a key removed
from it stops working without a restart; against a real `pyllama-paged serve` process with a
self-signed certificate made here."""

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys

import httpx
import ollama
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import free_ports, stop_server, wait_healthy

SERVE = [sys.executable, "-m", "pyllama_paged.cli", "serve"]


def self_signed(folder) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 and localhost, signed by that key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pyllama-paged test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """A served tiny model over HTTPS, keys from the command line (gamma) and a file (alpha,
    beta): (https URL, the certificate file, the key file)."""
    folder = tmp_path_factory.mktemp("team")
    model = write_tiny_model(folder / "tiny.gguf", "gemma3", weight_type="q8_0")
    key, cert = self_signed(folder)
    keys = folder / "keys.txt"
    keys.write_text("# the team's keys\nalpha\n\nbeta\n")
    (port,) = free_ports(1)
    log = folder / "serve.log"
    proc = subprocess.Popen(SERVE + ["--model", model, "--port", str(port), "--threads", "2", "--ctx", "512",
                                     "--kv-budget", "2048", "--ssl-keyfile", key, "--ssl-certfile", cert,
                                     "--api-key", "gamma", "--api-key-file", str(keys)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd="/")
    url = f"https://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/health", timeout=300, log=log, verify=ssl.create_default_context(cafile=cert))
        yield url, cert, keys
    finally:
        stop_server(proc)


def client(team, key: str) -> openai.OpenAI:
    """The unmodified openai client over https, trusting the test's certificate."""
    url, cert, _ = team
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=120))


def completes(team, key: str) -> bool:
    """Whether a completion with key is answered (False: refused as a wrong key)."""
    try:
        out = client(team, key).completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                                   temperature=0, extra_body={"ignore_eos": True})
    except openai.AuthenticationError as e:
        assert e.body["code"] == "invalid_api_key"
        return False
    assert out.usage.completion_tokens == 3
    return True


def test_the_openai_and_ollama_clients_talk_https(team):
    url, cert, _ = team
    assert [m.id for m in client(team, "alpha").models.list()] == ["tiny"]
    assert completes(team, "alpha")
    # the ollama client too, the key in its headers
    trusted = ssl.create_default_context(cafile=cert)
    oll = ollama.Client(host=url, verify=trusted, headers={"Authorization": "Bearer beta"})
    assert [m.model for m in oll.list().models] == ["tiny"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url, verify=trusted).list()
    assert e.value.status_code == 401
    # the server speaks TLS only, with the certificate given: unknown to the system's authorities
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="alpha", max_retries=0).models.list()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=30)


def test_every_key_given_opens_and_no_other(team):
    assert all(completes(team, key) for key in ("alpha", "beta", "gamma"))
    assert not completes(team, "delta")
    assert not completes(team, "# the team's keys")   # a comment is not a key
    assert not completes(team, "alph")


def test_a_key_removed_from_the_file_stops_working_without_a_restart(team):
    keys = team[2]
    replacement = keys.with_suffix(".new")   # an editor's way: a new file moved over the old one
    replacement.write_text("beta\ndelta\n")
    os.replace(replacement, keys)
    assert not completes(team, "alpha") and completes(team, "delta") and completes(team, "beta")
    keys.write_text("delta\n")   # rewritten in place
    assert not completes(team, "beta") and completes(team, "delta")
    keys.unlink()   # no file: none of its keys (a revocation fails closed); the command line's stays
    assert not completes(team, "delta") and completes(team, "gamma")
    keys.write_text("alpha\n")
    assert completes(team, "alpha")


@pytest.mark.parametrize("args,needle", [
    (["--ssl-keyfile", "/etc/hostname"], "both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/etc/hostname"], "no such file"),
    (["--api-key-file", "/nonexistent/keys.txt"], "--api-key-file /nonexistent/keys.txt"),
])
def test_bad_tls_or_key_options_are_said_before_anything_loads(args, needle):
    p = subprocess.run(SERVE + args, capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode != 0 and needle in p.stderr, p.stderr
