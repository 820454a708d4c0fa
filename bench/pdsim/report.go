package main

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"
)

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

const rowFmt = "%-40s %-9s %5s %5s %9s %9s %9s %8s %7s %8s | %8s %8s %8s %8s %8s | %6s %6s\n"

func printHeader(w io.Writer) {
	fmt.Fprintf(w, rowFmt, "shape", "mode", "reqs", "done", "TTFT mean", "median", "p99", "TPOT", "req/s", "MiB",
		"P queue", "prefill", "KV in", "D step", "to tok1", "P lag", "D lag")
}

func printRow(w io.Writer, r *result) {
	f1 := func(d []time.Duration) string { return fmt.Sprintf("%.1f", ms(mean(d))) }
	fmt.Fprintf(w, rowFmt, r.shape, r.mode, fmt.Sprint(r.requests), fmt.Sprint(r.done),
		f1(r.ttft), fmt.Sprintf("%.1f", ms(pct(r.ttft, 0.5))), fmt.Sprintf("%.1f", ms(pct(r.ttft, 0.99))),
		fmt.Sprintf("%.2f", ms(mean(r.tpot))), fmt.Sprintf("%.2f", r.reqPerSec()), fmt.Sprintf("%.1f", float64(r.kvBytes)/(1<<20)),
		f1(r.queue), f1(r.prefill), f1(r.kvIn), f1(r.notice), f1(r.tok1),
		fmt.Sprintf("%.1f%%", 100*r.lagP()), fmt.Sprintf("%.1f%%", 100*r.lagD()))
}

// byShape groups results by shape, in order.
func byShape(rs []*result) ([]shape, map[shape]map[mode]*result) {
	var order []shape
	m := map[shape]map[mode]*result{}
	for _, r := range rs {
		if m[r.shape] == nil {
			m[r.shape] = map[mode]*result{}
			order = append(order, r.shape)
		}
		m[r.shape][r.mode] = r
	}
	return order, m
}

func ratio(a, b time.Duration) string {
	if a <= 0 || b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", float64(a)/float64(b))
}

func over(a, b time.Duration) string {
	if a <= 0 || b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%+.1f%%", 100*(float64(a)/float64(b)-1))
}

// spread is the range of a per-run comparison over the runs of a and b
// (paired by seed), or "" for single runs.
func spread(a, b *result, f func(x, y float64) float64, format string) string {
	if a == nil || b == nil || len(a.runTTFT) < 2 || len(a.runTTFT) != len(b.runTTFT) {
		return ""
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range a.runTTFT {
		v := f(float64(a.runTTFT[i]), float64(b.runTTFT[i]))
		lo, hi = math.Min(lo, v), math.Max(hi, v)
	}
	return " (" + fmt.Sprintf(format, lo) + " to " + fmt.Sprintf(format, hi) + ")"
}

// comparison is one shape's summary: pull/push TTFT (the seeds' ratio)
// and push and layer-wise push against the no-transfer baseline; means
// carry the range over runs when a shape ran more than once.
type comparison struct {
	shape                        shape
	pullPushMean, pullPushMedian string
	pullPushP99, layerwiseVsBase string
	pushVsBase                   string
}

func compare(rs []*result) []comparison {
	order, m := byShape(rs)
	var out []comparison
	div := func(x, y float64) float64 { return x / y }
	rel := func(x, y float64) float64 { return 100 * (x/y - 1) }
	for _, s := range order {
		pu, ps, lw, b := m[s][modePull], m[s][modePush], m[s][modeLayerwise], m[s][modeBaseline]
		get := func(r *result, q float64) time.Duration {
			if r == nil || len(r.ttft) == 0 {
				return 0
			}
			if q < 0 {
				return mean(r.ttft)
			}
			return pct(r.ttft, q)
		}
		c := comparison{shape: s,
			pullPushMean:    ratio(get(pu, -1), get(ps, -1)),
			pullPushMedian:  ratio(get(pu, 0.5), get(ps, 0.5)),
			pullPushP99:     ratio(get(pu, 0.99), get(ps, 0.99)),
			layerwiseVsBase: over(get(lw, -1), get(b, -1)),
			pushVsBase:      over(get(ps, -1), get(b, -1))}
		if c.pullPushMean != "-" {
			c.pullPushMean += spread(pu, ps, div, "%.2fx")
		}
		if c.layerwiseVsBase != "-" {
			c.layerwiseVsBase += spread(lw, b, rel, "%+.1f%%")
		}
		if c.pushVsBase != "-" {
			c.pushVsBase += spread(ps, b, rel, "%+.1f%%")
		}
		out = append(out, c)
	}
	return out
}

// printSummary compares the modes per shape.
func printSummary(w io.Writer, rs []*result) {
	f := "%-40s %-26s %8s %8s %-26s %-26s\n"
	fmt.Fprintf(w, f, "shape", "pull/push mean", "median", "p99", "layerwise vs base", "push vs base")
	for _, c := range compare(rs) {
		fmt.Fprintf(w, f, c.shape, c.pullPushMean, c.pullPushMedian, c.pullPushP99, c.layerwiseVsBase, c.pushVsBase)
	}
}

// markdown renders the results as the table of bench/RESULTS.md.
func markdown(rs []*result) string {
	var b strings.Builder
	b.WriteString("| shape | mode | runs | requests | TTFT mean ms | TTFT median ms | TTFT p99 ms | TPOT mean ms | req/s | KV MiB verified | P queue ms | prefill ms | KV in ms | D step ms | to token 1 ms | P lag | D lag |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %s | %s | %d | %d/%d | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f%% | %.1f%% |\n",
			r.shape, r.mode, r.runs, r.done, r.requests, ms(mean(r.ttft)), ms(pct(r.ttft, 0.5)), ms(pct(r.ttft, 0.99)), ms(mean(r.tpot)),
			r.reqPerSec(), float64(r.kvBytes)/(1<<20), ms(mean(r.queue)), ms(mean(r.prefill)), ms(mean(r.kvIn)), ms(mean(r.notice)),
			ms(mean(r.tok1)), 100*r.lagP(), 100*r.lagD())
	}
	b.WriteString("\n| shape | pull/push TTFT mean | median | p99 | layer-wise vs baseline (mean) | push vs baseline (mean) |\n|---|---:|---:|---:|---:|---:|\n")
	for _, c := range compare(rs) {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", c.shape, c.pullPushMean, c.pullPushMedian, c.pullPushP99, c.layerwiseVsBase, c.pushVsBase)
	}
	return b.String()
}

var modeColors = []string{"#7f7f7f", "#d62728", "#1f77b4", "#2ca02c"}

// chart draws one panel per shape with the empirical CDF of TTFT per mode.
func chart(rs []*result) string {
	order, m := byShape(rs)
	const pw, ph, pad, cols = 360, 220, 50, 2
	rows := (len(order) + cols - 1) / cols
	W, H := cols*(pw+pad)+pad, rows*(ph+pad+30)+pad+30
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="%d" y="20" font-size="14">kvxfer pdsim: TTFT distribution (CDF) per mode</text>`+"\n", pad)
	for i, md := range modeNames {
		fmt.Fprintf(&b, `<rect x="%d" y="28" width="12" height="4" fill="%s"/><text x="%d" y="34">%s</text>`+"\n", pad+i*110, modeColors[i], pad+i*110+16, md)
	}
	for i, s := range order {
		x0 := pad + (i%cols)*(pw+pad)
		y0 := 50 + pad/2 + (i/cols)*(ph+pad+30)
		var xmax float64
		for _, r := range m[s] {
			if len(r.ttft) > 0 {
				xmax = math.Max(xmax, ms(r.ttft[len(r.ttft)-1]))
			}
		}
		xmax = niceCeil(xmax * 1.05)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", x0, y0-6, s)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", x0, y0, pw, ph)
		for k := 0; k <= 4; k++ {
			gx := x0 + k*pw/4
			fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#ddd"/><text x="%d" y="%d" text-anchor="middle">%.0f</text>`+"\n",
				gx, y0, gx, y0+ph, gx, y0+ph+14, xmax*float64(k)/4)
			gy := y0 + ph - k*ph/4
			fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%.2f</text>`+"\n", x0-4, gy+4, float64(k)/4)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">TTFT ms</text>`+"\n", x0+pw/2, y0+ph+28)
		if xmax <= 0 {
			continue
		}
		for md := range modeNames {
			r := m[s][mode(md)]
			if r == nil || len(r.ttft) == 0 {
				continue
			}
			var pts []string
			n := float64(len(r.ttft))
			prevY := float64(y0 + ph)
			for j, d := range r.ttft {
				x := float64(x0) + ms(d)/xmax*pw
				y := float64(y0+ph) - float64(j+1)/n*ph
				pts = append(pts, fmt.Sprintf("%.1f,%.1f %.1f,%.1f", x, prevY, x, y))
				prevY = y
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", modeColors[md], strings.Join(pts, " "))
		}
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// niceCeil rounds up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 0
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, f := range []float64{1, 2, 5, 10} {
		if f*p >= v {
			return f * p
		}
	}
	return 10 * p
}
