// bind_deltanet.cpp — cflow._native.deltanet_step: the Gated DeltaNet token step (deltanet.h) on
// numpy buffers, for tests against the float reference (tests/test_deltanet_step.py). The state
// arrays are updated in place, as the engine will keep them per sequence.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cflow.h"
#include "deltanet.h"

namespace nb = nanobind;

namespace {

template <typename T> using In1 = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T> using In2 = nb::ndarray<const T, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
template <typename T> using Inout = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

void check(size_t got, size_t want, const char *what) {
    if (got != want)
        throw nb::value_error((std::string("deltanet_step: ") + what + " has " + std::to_string(got) +
                               " elements, expected " + std::to_string(want)).c_str());
}

nb::ndarray<nb::numpy, float> deltanet_step(In2<float> conv_w, In1<float> dt_bias, In1<float> a, In1<float> norm_w,
                                            int n_k_heads, float eps, Inout<float> conv_state, Inout<float> ssm_state,
                                            In1<float> u, In1<float> z, In1<float> alpha, In1<float> beta) {
    cf_deltanet_layer L{};
    L.n_v_heads = (int)a.size();
    L.head_dim = (int)norm_w.size();
    L.n_k_heads = n_k_heads;
    L.conv_kernel = (int)conv_w.shape(1);
    L.eps = eps;
    if (n_k_heads <= 0 || L.n_v_heads % n_k_heads || L.head_dim <= 0 || L.conv_kernel < 1)
        throw nb::value_error("deltanet_step: need n_k_heads > 0 dividing len(a) (the v heads), len(norm_w) > 0 "
                              "and a conv kernel of at least 1 tap");
    const size_t C = (size_t)cf_deltanet_conv_dim(&L), V = (size_t)L.n_v_heads * L.head_dim;
    check(conv_w.shape(0), C, "conv_w's rows (2 Hk dh + Hv dh)");
    check(dt_bias.size(), (size_t)L.n_v_heads, "dt_bias");
    check(conv_state.size(), cf_deltanet_conv_state_floats(&L), "conv_state ((K-1) x conv_dim)");
    check(ssm_state.size(), cf_deltanet_ssm_state_floats(&L), "ssm_state (Hv x dh x dh)");
    check(u.size(), C, "u");
    check(z.size(), V, "z");
    check(alpha.size(), (size_t)L.n_v_heads, "alpha");
    check(beta.size(), (size_t)L.n_v_heads, "beta");
    L.conv_w = conv_w.data();
    L.dt_bias = dt_bias.data();
    L.a = a.data();
    L.norm_w = norm_w.data();
    float *scratch = new float[C];
    float *out = new float[V];
    cf_deltanet_step_ref(&L, conv_state.data(), ssm_state.data(), u.data(), z.data(), alpha.data(), beta.data(),
                         scratch, out);
    delete[] scratch;
    nb::capsule owner(out, [](void *p) noexcept { delete[] static_cast<float *>(p); });
    return nb::ndarray<nb::numpy, float>(out, {V}, owner);
}

// One head of the kernel table `isa` (cflow.h deltanet_head) on numpy buffers: S [dh, dh] updated in
// place, o returned; for tests of every table against the reference at any dh.
nb::ndarray<nb::numpy, float> deltanet_head(const std::string &isa, Inout<float> S, In1<float> q, In1<float> k,
                                            In1<float> v, float decay, float beta) {
    const cf_kernel_table *t = cf_kernels_by_name(isa.c_str());
    if (!t) throw nb::value_error(("deltanet_head: no kernel table '" + isa + "' on this CPU").c_str());
    const size_t dh = q.size();
    check(k.size(), dh, "k");
    check(v.size(), dh, "v");
    check(S.size(), dh * dh, "S (dh x dh)");
    float *o = new float[dh];
    t->deltanet_head(S.data(), q.data(), k.data(), v.data(), decay, beta, o, (int)dh);
    nb::capsule owner(o, [](void *p) noexcept { delete[] static_cast<float *>(p); });
    return nb::ndarray<nb::numpy, float>(o, {dh}, owner);
}

} // namespace

void cf_bind_deltanet(nb::module_ &m) {
    using nb::arg;
    m.def("deltanet_head", &deltanet_head, arg("isa"), arg("S"), arg("q"), arg("k"), arg("v"), arg("decay"),
          arg("beta"), "One Gated DeltaNet head of kernel table `isa` (cflow.h deltanet_head): updates S in place "
          "and returns S^T q.");
    m.def("deltanet_step", &deltanet_step, arg("conv_w"), arg("dt_bias"), arg("a"), arg("norm_w"), arg("n_k_heads"),
          arg("eps"), arg("conv_state"), arg("ssm_state"), arg("u"), arg("z"), arg("alpha"), arg("beta"),
          "One token of a Gated DeltaNet layer (Qwen3.5), scalar reference: updates conv_state and ssm_state in "
          "place and returns the gated, normalised output that ssm_out multiplies.");
}
